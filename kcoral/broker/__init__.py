"""The host broker and the federation router."""
