"""The federation router: one client endpoint for the host brokers of many GPU machines."""
