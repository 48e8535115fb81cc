# The broker for the contract's runner test: KAFOLD_TEST_BOOTSTRAP, else a private `kafold dev` stack.
pytest_plugins = ["kafold.tools.dev.fixtures"]
