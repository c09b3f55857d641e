"""Compute Engine regions and their zones (one table), and the offline check of a zone name.

``launcher cluster config`` and the rehearsal's local Compute API have no
credentials to ask a project which zones exist, so they check a zone against
this table: its name is ``REGION-LETTER``, its region is one Compute Engine
has, and, where the table knows the region's zones, the letter is one of them
(``us-central1`` has a, b, c and f; ``us-east1`` and ``europe-west1`` have b,
c and d). Preflight still asks the real project (``zones.get``), which also
knows a zone that is down.

Source: Google's "Regions and zones" page
(cloud.google.com/compute/docs/regions-zones) and ``gcloud compute zones
list``, 2025. A region Google opens later is refused until it is added here;
``None`` marks a region whose zones the table does not list (only the region
is checked).
"""

from __future__ import annotations

import difflib
import re

from launcher.errors import UserError

ZONE_RE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-([a-z])$")
EXAMPLE = "us-central1-a"

# region -> its zones' letters (None: not listed, any letter passes)
REGIONS: dict[str, str | None] = {
    "africa-south1": "abc",
    "asia-east1": "abc", "asia-east2": "abc",
    "asia-northeast1": "abc", "asia-northeast2": "abc", "asia-northeast3": "abc",
    "asia-south1": "abc", "asia-south2": "abc",
    "asia-southeast1": "abc", "asia-southeast2": "abc",
    "australia-southeast1": "abc", "australia-southeast2": "abc",
    "europe-central2": "abc", "europe-north1": "abc", "europe-north2": None, "europe-southwest1": "abc",
    "europe-west1": "bcd", "europe-west2": "abc", "europe-west3": "abc", "europe-west4": "abc",
    "europe-west6": "abc", "europe-west8": "abc", "europe-west9": "abc", "europe-west10": "abc",
    "europe-west12": "abc",
    "me-central1": "abc", "me-central2": "abc", "me-west1": "abc",
    "northamerica-northeast1": "abc", "northamerica-northeast2": "abc", "northamerica-south1": "abc",
    "southamerica-east1": "abc", "southamerica-west1": "abc",
    "us-central1": "abcf",
    "us-east1": "bcd", "us-east4": "abc", "us-east5": "abc",
    "us-south1": "abc",
    "us-west1": "abc", "us-west2": "abc", "us-west3": "abc", "us-west4": "abc",
}


def region_zones(region: str) -> list[str]:
    """The zones the table lists for a region ([] for an unknown region or unlisted zones)."""
    return [f"{region}-{letter}" for letter in REGIONS.get(region) or ""]


def zone_problem(zone: str) -> tuple[str, list[str]] | None:
    """Why ``zone`` is not a Compute Engine zone, and the nearest zones that are; None if it may be one."""
    m = ZONE_RE.match(zone)
    if not m:
        every = [z for r in REGIONS for z in region_zones(r)]
        near = region_zones(zone)[:1] if zone in REGIONS else difflib.get_close_matches(zone, every, n=2)
        return f"zone {zone!r} is not a zone name (REGION-LETTER)", near
    region, letter = m.groups()
    if region not in REGIONS:
        near = [_nearest_zone(r, letter) for r in difflib.get_close_matches(region, REGIONS, n=2)]
        return f"zone {zone!r} is in {region}, which is not a Compute Engine region", near
    if letter not in (REGIONS[region] or letter):
        return (f"zone {zone!r} does not exist: {region}'s zones are {', '.join(region_zones(region))}",
                [_nearest_zone(region, letter)])
    return None


def check_zone(zone: str, flag: str = "--zone") -> str:
    """The region of a zone the table knows.

    Raises:
        UserError: what is wrong with the zone, the nearest real ones and ``flag`` to fix it with.
    """
    problem = zone_problem(zone)
    if problem:
        why, near = problem
        hint = f"did you mean {' or '.join(near)}? " if near else f"(e.g. {EXAMPLE}) "
        raise UserError(why, f"{hint}set {flag} to a zone of `gcloud compute zones list`")
    return ZONE_RE.match(zone).group(1)


def _nearest_zone(region: str, letter: str) -> str:
    """The region's zone with this letter, else the one with the closest letter (us-central1-z -> -f)."""
    letters = REGIONS.get(region) or letter
    return f"{region}-{min(letters, key=lambda c: abs(ord(c) - ord(letter)))}"
