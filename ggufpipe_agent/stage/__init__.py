"""One stage's run: its state machine, the step, the record hand-over in a
shared process, the checks of a provision."""
