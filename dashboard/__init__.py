"""Streamlit diagnostics app (read-only over the store)."""
