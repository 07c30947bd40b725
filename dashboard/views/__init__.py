"""One module per page of the app (dashboard/app.py routes to them)."""
