"""The Loader: settings, the per-worker stream and its state, resume, sizing, workers."""
