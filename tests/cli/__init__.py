"""`kafold run` end to end: the stack, topics, the daemon and traffic, stopped by Ctrl-C whatever its output is."""
