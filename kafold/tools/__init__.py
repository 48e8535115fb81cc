"""kafold's tools, beside the core: the `kafold` command line (kafold.tools.cli, kafold.tools.commands), the
benchmarks (kafold.tools.bench) and the local dev stack (kafold.tools.dev). The core never imports them."""
