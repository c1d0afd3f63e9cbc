"""The worker side: zygote, program interpreter, sandbox, output capture."""
