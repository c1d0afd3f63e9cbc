"""The host broker: client and worker sockets, program intake, leases, blobs, the zygote
supervisor and the upstream relay."""
