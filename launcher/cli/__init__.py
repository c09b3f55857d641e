"""The ``launcher`` command line: :mod:`~launcher.cli.main` parses and dispatches.

One module per command group; each parses its flags, calls one library
function and prints. Subcommands share the run flags through
:mod:`~launcher.cli.options` and never import :mod:`~launcher.cli.main`.
Nothing here imports torch, TensorFlow, Ray Train or a Google client at
module level, so ``launcher --help`` is instant; and since ``main`` imports
every command module, a handler imports its command's implementation when it
runs (rule (d) in :mod:`launcher._deferred`).
"""
