"""What the load shares with GPU replicas (cluster.placement.load_nodes, shared_load_notes), on node
lists shaped as ray.nodes() gives them: on an all-GPU cluster the driver, router and Locust workers
share GPU nodes and the notes say so; a GPU-less head and CPU-only nodes keep them apart."""

from __future__ import annotations

from cluster.placement import load_nodes, shared_load_notes


def node(node_id: str, ip: str, gpus: float, cpus: float = 8) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": True, "Resources": {"CPU": cpus, "GPU": gpus}}


ALL_GPU = [node("head" + "0" * 12, "10.0.0.1", 2), node("gpu1" + "0" * 12, "10.0.0.2", 8)]
CPU_HEAD = [node("head" + "0" * 12, "10.0.0.1", 0), node("gpu1" + "0" * 12, "10.0.0.2", 8)]


def test_an_all_gpu_cluster_shares_gpu_nodes_with_the_load():
    driver = ALL_GPU[0]["NodeID"]
    locust = load_nodes("auto", 2, ALL_GPU, driver)
    assert sorted(locust) == sorted(n["NodeID"] for n in ALL_GPU)  # no CPU-only node: spread over all
    notes = shared_load_notes(ALL_GPU, driver, locust, 2)
    assert notes[0].startswith("load: the driver and the router run on GPU node 10.0.0.1 (head00000000)")
    assert notes[1].startswith("load: 2 Locust worker(s) share GPU node(s) 10.0.0.1, 10.0.0.2 with the replicas")


def test_a_gpu_less_head_keeps_the_driver_router_and_locust_off_the_gpu_nodes():
    driver = CPU_HEAD[0]["NodeID"]
    locust = load_nodes("auto", 2, CPU_HEAD, driver)
    assert locust == [driver]
    assert shared_load_notes(CPU_HEAD, driver, locust, 2) == []
    # `spread` does not keep to the CPU-only head: the notes say where it may land
    spread = load_nodes("spread", 2, CPU_HEAD, driver)
    assert shared_load_notes(CPU_HEAD, driver, spread, 2) == [
        "load: 2 Locust worker(s) share GPU node(s) 10.0.0.2 with the replicas (experiment.worker_placement lets "
        "them there): their CPU use is in the arms' latency"]


def test_no_workers_means_only_the_driver_and_router():
    driver = ALL_GPU[1]["NodeID"]
    assert load_nodes("auto", 0, ALL_GPU, driver) == [driver]
    notes = shared_load_notes(ALL_GPU, driver, [driver], 0)
    assert len(notes) == 1 and "driver and the router run on GPU node 10.0.0.2" in notes[0]


def test_the_report_says_what_the_load_shared_in_one_line(tmp_path):
    from rollout.record.html import html_report
    from rollout.record.markdown import markdown_report
    from tests.test_result import recorded_document

    doc = recorded_document("promote")
    assert "Load placement" not in markdown_report(doc) and "Load placement" not in html_report(doc, tmp_path)
    notes = shared_load_notes(ALL_GPU, ALL_GPU[0]["NodeID"], load_nodes("auto", 2, ALL_GPU, ALL_GPU[0]["NodeID"]), 2)
    doc["prepare"]["load_placement"] = "; ".join(n.removeprefix("load: ") for n in notes)
    markdown = [line for line in markdown_report(doc).splitlines() if "Load placement" in line]
    assert len(markdown) == 1 and markdown[0].startswith("**Load placement**: the driver and the router run on GPU")
    assert "2 Locust worker(s) share GPU node(s) 10.0.0.1, 10.0.0.2" in markdown[0]
    page = html_report(doc, tmp_path)
    assert page.count('id="load-placement"') == 1 and "2 Locust worker(s) share GPU node(s)" in page
