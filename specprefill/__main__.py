from specprefill.cli import main

main()
