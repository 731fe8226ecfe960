"""The plain layer: helpers that import no torch (errors, paths, units, settings, the catalogue, recordings, the
frontier figure).  The UI and the recording player stand on it alone; a contract (`.importlinter`) keeps torch out."""
