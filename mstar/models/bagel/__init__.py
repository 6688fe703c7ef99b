"""BAGEL (``ByteDance-Seed/BAGEL-7B-MoT``): text and images in, text or an image out; ``bagel-tiny`` runs offline."""
