"""How a message reaches a user: one line, whatever the text it quotes (both front ends' errors)."""


def one_line(text: str) -> str:
    """An error message as one line: control characters (a newline in a file name given) escaped."""
    return "".join(ch if ch.isprintable() or ch == " " else ascii(ch)[1:-1] for ch in text.strip())
