from ._cli import console

console()
