"""kafold's test suite: one package per subject; what the folders share is in tests.support."""
