"""Security features: encrypted models at rest (``pagoda encrypt``, pagoda/security/encryption.py).

Import-light on purpose: ``pagoda --help`` imports the encrypt verb's parser from here, and nothing in
this package imports ``cryptography`` (or torch) until a container is written or read.
"""
