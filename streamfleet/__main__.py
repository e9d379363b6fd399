from streamfleet.cli import app

app(prog_name="streamfleet")
