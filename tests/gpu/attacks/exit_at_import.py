"""The exit_at_import cheat: harness tampering; run through the trusted path, kcoral remote on the matmul workload."""

import os

os._exit(0)
