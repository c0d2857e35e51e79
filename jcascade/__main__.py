from jcascade.cli import main

main()
