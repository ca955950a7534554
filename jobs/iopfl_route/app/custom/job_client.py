"""What every pflseg job carries as its client script (app/custom/job_client.py): it runs the one
Client API script, ``pflseg.flare.client``, from the pflseg package installed at the site."""

from pflseg.flare.client import main

if __name__ == "__main__":
    main()
