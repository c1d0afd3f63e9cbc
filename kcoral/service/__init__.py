"""What the broker and the router share as services: sockets, authentication, fair share."""
