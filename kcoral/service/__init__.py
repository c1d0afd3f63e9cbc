"""What every KCoral service (the host broker, the router) is built on: the client-facing shell,
its sockets and its tasks, who may connect (``auth``), each client's fair share (``fairness``), the
queue of programs waiting to start (``queue``), what a service says of itself (``identity``) and its
Prometheus metrics (``metrics``). It imports neither the broker nor the router."""
