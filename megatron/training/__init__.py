"""Chameleon's training layer, in Megatron-LM's shape (beside the installed megatron.core)."""
