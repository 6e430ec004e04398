"""The `edgellm` subcommands, a module each (its arguments and what it runs): generate and chat,
serve, models; engine_args holds the engine flags they share. edgellm/cli.py puts them together
with convert (edgellm/quant/convert_cli.py) and bench (edgellm/bench)."""
