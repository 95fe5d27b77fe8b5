"""The data side applied to unchanged programs: what changes when a DataLoader is built or
iterated while the data patches are installed, and how long the training loop waits on it."""
