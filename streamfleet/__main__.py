from streamfleet.cli import app

# guarded: a speech worker's decoder processes start by "spawn", which imports this
# module again (as __mp_main__) in each child
if __name__ == "__main__":
    app(prog_name="streamfleet")
