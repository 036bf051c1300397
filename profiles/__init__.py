"""Hardware profiles as data (installed as the package `lorakit.profiles`)."""
