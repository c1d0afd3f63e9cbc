"""The client library: Program builder, Client and AsyncClient, results."""
