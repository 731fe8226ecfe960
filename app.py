"""KV-Direct Studio: the side-by-side web app (`make demo`, or `python app.py`; a Space runs the latter;
`kvdirect-studio` once the package is installed).  See kvdirect_app/app/studio.py for the settings it reads."""

from kvdirect_app.app.studio import main

if __name__ == "__main__":
    main()
