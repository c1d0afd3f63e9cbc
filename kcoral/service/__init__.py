"""What every KCoral service (the host broker, the router) is built on: the client-facing shell,
its sockets and its tasks, who may connect (``auth``), and each client's fair share (``fairness``)."""
