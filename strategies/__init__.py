"""Drop-in Flower strategies for fleets of unequal devices."""

__all__: list[str] = []
