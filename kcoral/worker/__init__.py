"""The worker side: zygote, program interpreter, output capture."""
