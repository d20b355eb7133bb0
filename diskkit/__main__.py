from diskkit.cli.commands import main

main()
