from launcher.cli.commands import main

main()
