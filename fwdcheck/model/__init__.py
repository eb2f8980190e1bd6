"""The model under test: one face over every model source (tested.ModelUnderTest), what a model can do as the
checks ask it (capabilities), the built-in reference transformer, and sources/, one module per `source:`."""
