from hutch.cli import main

main()
