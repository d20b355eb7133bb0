"""`diskkit tags`, `tag`, `promote`, `delete` and `prune`: a repository's tags as things to list, add, publish and remove safely."""

from __future__ import annotations

import json

import click

from diskkit.cli.shell import registry_options
from diskkit.cli.trustflags import signature_options
from diskkit.registry.options import RegistryOptions


@click.command("tags", epilog="""\b
Examples:
  diskkit tags --tls-verify=false docker://localhost:5000/disks/fedora
  diskkit tags --json quay.io/containerdisks/fedora
""")
@click.argument("repository", metavar="REPOSITORY")
@click.option("--json", "as_json", is_flag=True, help='Print {"Repository": ..., "Tags": [...]}.')
@registry_options
def tags_cmd(repository, as_json, registry: RegistryOptions) -> None:
    """List every tag of a registry repository, one per line (all pages of the tag list)."""
    from diskkit.ops.tags import list_tags, open_repo, repository_only

    repo = open_repo(repository_only(repository), registry, "pull")
    tags = list_tags(repo)
    if as_json:
        click.echo(json.dumps({"Repository": str(repo), "Tags": tags}, indent=4))
    else:
        for tag in tags:
            click.echo(tag)


@click.command("tag", epilog="""\b
Examples:
  diskkit tag --tls-verify=false localhost:5000/disks/fedora@sha256:4f5e... 40 latest
  diskkit tag --json localhost:5000/disks/fedora:40-2611251200 40 latest
""")
@click.argument("source", metavar="REPOSITORY:TAG|REPOSITORY@DIGEST")
@click.argument("new_tags", metavar="TAG...", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@registry_options
def tag_cmd(source, new_tags, as_json, registry: RegistryOptions) -> None:
    """Put the same manifest under more tags of its repository.

    The manifest's bytes are stored unchanged (an index stays the whole index; no blob is copied) and
    each new tag is read back: it must point at the source's digest.
    """
    from diskkit.ops.tags import add_tags

    digest, tags = add_tags(source, new_tags, registry)
    click.echo(json.dumps({"source": source, "digest": digest, "tags": tags}, indent=2) if as_json else digest)


@click.command("delete", epilog="""\b
Examples:
  diskkit delete --tls-verify=false docker://localhost:5000/disks/test:old
  diskkit delete --ignore-missing --json localhost:5000/disks/test:40-2611251200
  diskkit delete --force localhost:5000/disks/test:40-2611251200   # 40 and latest go too
""")
@click.argument("ref")
@click.option("--force", is_flag=True, help="Delete even when other tags point at the same digest (they are removed too).")
@click.option("--ignore-missing", is_flag=True, help="A tag that does not exist is not an error: say so and exit 0.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@registry_options
def delete_cmd(ref, force, ignore_missing, as_json, registry: RegistryOptions) -> None:
    """Delete an image's manifest from a registry (the registry must allow deletes).

    A manifest is deleted by digest, which removes every tag pointing at it: deleting REPO:TAG is
    refused, naming them, when other tags point at the same digest, unless --force. Deleting
    REPO@DIGEST removes the digest and lists the tags it took with it.
    """
    from diskkit.ops.tags import delete

    result = delete(ref, registry, force=force, ignore_missing=ignore_missing)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif not result.deleted:
        click.echo(f"{result.reference}: no such tag; nothing deleted")
    else:
        click.echo(result.digest)


@click.command("prune", epilog="""\b
Examples:
  diskkit prune --tls-verify=false localhost:5000/disks/fedora --match '40-[0-9]{10}' --keep 3 --dry-run
  diskkit prune --json quay.io/me/fedora --match '40-.*' --keep 5
""")
@click.argument("repository", metavar="REPOSITORY")
@click.option("--match", "pattern", required=True, metavar="REGEX", help="Tags to prune: those the whole of REGEX matches (Python syntax).")
@click.option("--keep", type=click.IntRange(0), required=True, metavar="N", help="How many matching tags to keep, newest first by the image config's created time.")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the digests deleted with their tags, and the tags kept with why.")
@registry_options
def prune_cmd(repository, pattern, keep, dry_run, as_json, registry: RegistryOptions) -> None:
    """Delete the older tags matching REGEX, keeping the newest N.

    Newest is by the image's created time (an index's: its newest platform image's). A manifest is
    deleted by digest, taking every tag on it, so a digest that a tag being kept still points at
    (one not matching REGEX, or one of the newest N), or that a kept index lists, is never deleted.
    A tag whose config has no created time is kept.
    """
    from diskkit.ops.prune import prune

    plan = prune(repository, pattern, keep, registry, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, **plan.to_json()}, indent=2))
        return
    verb = "would delete" if dry_run else "deleted"
    for digest, tags in plan.delete.items():
        click.echo(f"{verb} {digest} ({', '.join(tags)})")
    for tag, why in plan.keep.items():
        click.echo(f"kept {tag}: {why}")


@click.command("promote", epilog="""\b
Examples:
  diskkit promote --tls-verify=false localhost:5000/ci/fedora@sha256:4f5e... localhost:5000/disks/fedora --tags 40-2611251200,40,latest
  diskkit promote --dest-creds me:pw --json ci.local/fedora@sha256:4f5e... quay.io/me/fedora --tags 40 --tags latest
""")
@click.argument("source", metavar="REPOSITORY@DIGEST")
@click.argument("dest", metavar="DEST")
@click.option("--tags", "tag_values", multiple=True, required=True, metavar="TAG[,TAG...]", help="The tags DEST gets (comma-separated, or --tags repeated); the first one is pushed with the image.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object; events as JSON lines on stderr.")
@click.option("--src-tls-verify", type=click.BOOL, metavar="BOOL", help="--tls-verify for the source registry only.")
@click.option("--dest-tls-verify", type=click.BOOL, metavar="BOOL", help="--tls-verify for the destination registry only.")
@click.option("--src-creds", metavar="USER:PASS", help="--creds for the source registry only.")
@click.option("--dest-creds", metavar="USER:PASS", help="--creds for the destination registry only.")
@registry_options
@signature_options(sign=False)
def promote_cmd(source, dest, tag_values, as_json, src_tls_verify, dest_tls_verify, src_creds, dest_creds, registry: RegistryOptions, trust) -> None:
    """Publish a tested digest: copy REPOSITORY@DIGEST to repository DEST under every --tags tag, checked.

    An index is copied whole, every platform's image with it (never narrowed to this host's);
    blobs DEST already has are skipped, blobs in another repository of the same registry mounted.
    The manifest keeps its bytes (a copy that would rewrite it is refused), and each DEST tag is
    read back at the end: it must point at exactly DIGEST. The source must pass the signature
    policy first. Prints the digest.
    """
    from dataclasses import replace

    from diskkit.ops.promote import promote, split_tags
    from diskkit.progress import reporter_for
    from diskkit.signing.trust import enforce_ref

    tags = split_tags(tag_values)
    src_opts = replace(registry, **{k: v for k, v in (("tls_verify", src_tls_verify), ("creds", src_creds)) if v is not None})
    dest_opts = replace(registry, **{k: v for k, v in (("tls_verify", dest_tls_verify), ("creds", dest_creds)) if v is not None})
    enforce_ref(source, trust, src_opts, None, "every")
    result = promote(source, dest, tags, src_opts, dest_opts, reporter_for(as_json))
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else result.digest)


TAG_COMMANDS = (tags_cmd, tag_cmd, promote_cmd, delete_cmd, prune_cmd)
