"""The three peer roles of a DeDLOC run: trainer, auxiliary, monitor."""
