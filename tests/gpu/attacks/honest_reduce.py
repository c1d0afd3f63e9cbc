"""The honest candidate of the reduce workload, timed before each cheat."""


def custom_kernel(x):
    return x.sum()
