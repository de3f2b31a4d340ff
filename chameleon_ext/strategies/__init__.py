"""Recovery strategies: each turns a plan and a set of failed ranks into candidate plans."""
