"""Short names for writing op lists by hand in tests."""

from chameleon_ext.schedule.ir import Op, OpKind as K


def F(mb):
    return Op(K.FWD, mb)


def B(mb):
    return Op(K.BWD, mb)


def BI(mb):
    return Op(K.BWD_INPUT, mb)


def BW(mb):
    return Op(K.BWD_WEIGHT, mb)


def SF(mb, peer):
    return Op(K.SEND_FWD, mb, peer)


def RF(mb, peer):
    return Op(K.RECV_FWD, mb, peer)


def SB(mb, peer):
    return Op(K.SEND_BWD, mb, peer)


def RB(mb, peer):
    return Op(K.RECV_BWD, mb, peer)


RED = Op(K.REDUCE_GRADS)
OPT = Op(K.OPT_STEP)
END = [RED, OPT]
