"""Deliberate contract violations for the simulator tests: functions that corrupt one argument of
an op call's keyword arguments (a dict) in place."""


def set_(key, value):
    return lambda kw: kw.__setitem__(key, value)


def drop(key):
    return lambda kw: kw.pop(key)


def apply(key, fn):
    return lambda kw: kw.__setitem__(key, fn(kw[key]))
