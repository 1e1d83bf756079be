from dspec_cli.cli import main

main()
