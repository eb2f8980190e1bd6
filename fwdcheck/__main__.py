from fwdcheck.cli import main

main()
