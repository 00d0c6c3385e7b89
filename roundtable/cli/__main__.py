from roundtable.cli import main

main()
