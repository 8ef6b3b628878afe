//! MIG end to end (simulated GPUs, real Docker): an admin partitions a GPU, its agent makes the
//! layout and reports the devices, a session asking for a MIG device gets one and sees its
//! MIG UUID in NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES, and a whole-GPU session goes to
//! the other GPU.

use std::time::Duration;

use ongrid_e2e::{docker_exec, SimGpu, Site};
use serde_json::Value;

fn a100_80(n: u8) -> SimGpu {
    SimGpu {
        uuid: format!("GPU-a100a100-0000-4000-8000-0000000080{n:02x}"),
        model: "NVIDIA A100-SXM4-80GB",
        capability: "8.0",
        memory: "81920MiB",
    }
}

#[test]
fn a_session_on_a_mig_device_gets_its_uuid() {
    let mig_gpu = a100_80(1);
    let whole = SimGpu::a100(2);
    let mut site = Site::start(&[mig_gpu.clone(), whole.clone()]);
    let alice = site.user("Alice");
    let admin = site.admin.clone();

    // A layout the model cannot have is refused, naming its profiles.
    let out = site.devctl(
        &admin,
        &["admin", "gpu", "mode", &mig_gpu.uuid, "mig:1g.5gb*7"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    println!(
        "$ devctl admin gpu mode {} mig:1g.5gb*7\n{err}",
        mig_gpu.uuid
    );
    assert!(!out.status.success());
    assert!(err.contains("A100-80GB has no MIG profile 1g.5gb"), "{err}");

    let out = site.devctl_ok(
        &admin,
        &[
            "admin",
            "gpu",
            "mode",
            &mig_gpu.uuid,
            "mig:3g.40gb*1+2g.20gb*2",
        ],
    );
    println!(
        "$ devctl admin gpu mode {} mig:3g.40gb*1+2g.20gb*2\n{out}",
        mig_gpu.uuid
    );
    assert!(
        out.contains("is now mig:3g.40gb*1+2g.20gb*2: 3 MIG devices"),
        "{out}"
    );

    // The agent makes the layout and reports its devices.
    let devices: Vec<Value> = site.wait_until(
        "the agent to report the MIG devices",
        Duration::from_secs(30),
        || {
            let nodes: Vec<Value> = site.devctl_json(&admin, &["gpus"]).ok()?;
            let gpu = nodes
                .iter()
                .flat_map(|n| n["gpus"].as_array().cloned().unwrap_or_default())
                .find(|g| g["info"]["uuid"] == mig_gpu.uuid.as_str())?;
            let devices = gpu["info"]["mig_devices"].as_array()?.clone();
            (devices.len() == 3).then_some(devices)
        },
    );
    let profiles: Vec<&str> = devices
        .iter()
        .map(|d| d["profile"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(profiles, ["3g.40gb", "2g.20gb", "2g.20gb"]);

    site.devctl_ok(
        &alice,
        &[
            "session", "new", "--name", "slice", "--mig", "2g.20gb", "--wait",
        ],
    );
    let view = site.wait_for_state(&alice, "slice", "WAITING");
    let device = view["gpus"][0].as_str().expect("a device").to_owned();
    assert!(device.starts_with("MIG-"), "{view}");
    assert!(
        devices[1..].iter().any(|d| d["uuid"] == device.as_str()),
        "{device} is not one of the 2g.20gb devices"
    );
    let container = view["container"].as_str().expect("container").to_owned();
    let (code, env) = docker_exec(
        &container,
        &[
            "sh",
            "-c",
            "echo \"$NVIDIA_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES\"",
        ],
    );
    assert_eq!(code, 0);
    assert_eq!(env.trim(), format!("{device} {device}"));

    // A whole-GPU session never lands on the GPU in MIG mode.
    site.devctl_ok(&alice, &["session", "new", "--name", "whole", "--wait"]);
    let view = site.wait_for_state(&alice, "whole", "WAITING");
    assert_eq!(view["gpus"][0], whole.uuid.as_str());

    let out = site.devctl_ok(&alice, &["session", "show", "slice"]);
    println!("$ devctl session show slice\n{out}");
    let out = site.devctl_ok(&admin, &["gpus"]);
    println!("$ devctl gpus\n{out}");
    assert!(out.contains(&format!("└ {device}")), "{out}");
    assert!(out.contains("MIG 3g.40gb"), "{out}");
}
