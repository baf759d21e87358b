"""A kustomize `build` in Python for the subset deploy/k8s uses, so the tests render the manifests offline with no binary.

Supported: resources (files and directories), namespace, labels (metadata only), configMapGenerator (files,
`generatorOptions.disableNameSuffixHash: true`), images (newName/newTag), patches (RFC 6902 JSON patches in a
file, applied with the jsonpatch library, target by kind and name). Anything else in a kustomization.yaml raises,
so the manifests cannot use a feature this renderer would silently skip. Cross-checked by hand against
`kubectl kustomize` (v5.5.0) on a machine that has it: the same objects (README "Outgrowing one machine").
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

_SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "generatorOptions", "configMapGenerator", "images", "patches"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass", "CustomResourceDefinition"}

Obj = dict[str, Any]


def build(folder: Path) -> list[Obj]:
    """The objects `kustomize build folder` emits (order aside)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - _SUPPORTED
    if unknown:
        raise NotImplementedError(f"{folder}/kustomization.yaml uses {sorted(unknown)}, which tests/unit/k8s/kustomize.py does not render")
    objects: list[Obj] = []
    for resource in spec.get("resources", []):
        path = folder / resource
        objects += build(path) if path.is_dir() else [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    objects += _config_maps(folder, spec)
    for patch in spec.get("patches", []):
        objects = [_patched(obj, folder / patch["path"], patch["target"]) for obj in objects]
    for obj in objects:
        _transform(obj, spec)
    return objects


def _config_maps(folder: Path, spec: Obj) -> list[Obj]:
    generators = spec.get("configMapGenerator", [])
    if generators and not (spec.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        raise NotImplementedError("configMapGenerator without disableNameSuffixHash: true (name hashes are not rendered)")
    maps = []
    for generator in generators:
        data = {}
        for entry in generator["files"]:
            key, _, path = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
            data[key] = (folder / path).read_text()
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    return maps


def _patched(obj: Obj, path: Path, target: Obj) -> Obj:
    if set(target) - {"kind", "name"}:
        raise NotImplementedError(f"patch target {target}: only kind and name are rendered")
    if obj["kind"] != target.get("kind", obj["kind"]) or obj["metadata"]["name"] != target.get("name", obj["metadata"]["name"]):
        return obj
    return jsonpatch.apply_patch(obj, yaml.safe_load(path.read_text()))


def _transform(obj: Obj, spec: Obj) -> None:
    if spec.get("namespace") and obj["kind"] not in _CLUSTER_SCOPED:
        obj["metadata"]["namespace"] = spec["namespace"]
    for label in spec.get("labels", []):
        if set(label) - {"pairs"}:
            raise NotImplementedError(f"labels entry {label}: only `pairs` (metadata labels) is rendered")
        obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in spec.get("images", []):
        for container in containers(obj):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"


def containers(obj: Obj) -> list[Obj]:
    """The containers of a workload's pod template ([] for other kinds)."""
    pod = (obj.get("spec") or {}).get("template", {}).get("spec", {})
    return pod.get("initContainers", []) + pod.get("containers", [])


def by_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {obj["metadata"]["name"]: copy.deepcopy(obj) for obj in objects if obj["kind"] == kind}
