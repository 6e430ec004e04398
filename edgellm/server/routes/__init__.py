"""The app's routes, one module per concern; each module's `add_routes` adds its routes to
the app (`create_app`, server/app.py)."""
