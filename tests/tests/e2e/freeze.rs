//! Freezing a session end to end: `devctl freeze` against the real manager, agent and Docker,
//! the SIF checked with siftool and unsquashfs, the matching Docker image run with `docker run`,
//! then `devctl image ls|show|rm`.

use std::process::Command;
use std::time::Duration;

use ongrid_e2e::{docker_exec, SimGpu, Site};
use serde_json::Value;

fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} must be installed: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_running_session_freezes_into_an_image_users_can_inspect_and_remove() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    let bob = site.user("Bob");
    let login = site.login_of("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let view = site.wait_for_state(&alice, "train1", "WAITING");
    let container = view["container"].as_str().expect("container").to_owned();
    // As root (docker exec -u 0): /opt is the system's; the home directory is a volume and is
    // not part of an image.
    tool(
        "docker",
        &[
            "exec",
            "-u",
            "0",
            &container,
            "bash",
            "-c",
            "mkdir -p /opt/model && echo 'weights v1' > /opt/model/weights.txt \
             && chmod 644 /opt/model/weights.txt",
        ],
    );

    // devctl freeze waits and prints where the result is.
    let out = site.devctl(&alice, &["freeze", "train1", "--tag", "mymodel:v1"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "freeze failed: {stdout}\n{stderr}\n{}",
        site.logs()
    );
    assert!(stdout.starts_with("image mymodel:v1 is READY"), "{stdout}");
    assert!(
        stderr.contains("freezing session train1 to mymodel:v1"),
        "{stderr}"
    );
    let docker_image = format!("ongrid/{login}/mymodel:v1");
    assert!(stdout.contains(&docker_image), "{stdout}");

    let image: Value = site
        .devctl_json(&alice, &["image", "show", "mymodel:v1"])
        .expect("image show");
    assert_eq!(image["state"], "READY");
    assert_eq!(image["session"], "train1");
    assert_eq!(image["docker_image"], docker_image.as_str());
    let sif = image["sif_path"].as_str().expect("sif path").to_owned();
    let digest = image["digest"].as_str().expect("digest").to_owned();
    assert!(
        stdout.contains(&sif) && stdout.contains(&digest),
        "{stdout}"
    );
    assert!(sif.starts_with(&site.dir.path().join("images").display().to_string()));

    // The SIF, checked with siftool and unsquashfs.
    let list = tool("siftool", &["list", &sif]);
    let fs = list
        .lines()
        .find(|l| l.contains("Squashfs"))
        .unwrap_or_else(|| panic!("no squashfs partition:\n{list}"));
    let offset = fs
        .split('|')
        .nth(3)
        .expect("position")
        .trim()
        .split('-')
        .next()
        .expect("start");
    let listing = tool("unsquashfs", &["-o", offset, "-lln", &sif]);
    assert!(
        listing.contains("squashfs-root/opt/model/weights.txt"),
        "{listing}"
    );
    assert!(!listing.contains("squashfs-root/.dockerenv"));

    // The Docker image runs what the session has.
    let run = tool(
        "docker",
        &[
            "run",
            "--rm",
            &docker_image,
            "cat",
            "/opt/model/weights.txt",
        ],
    );
    assert_eq!(run, "weights v1\n");

    // Listing and privacy; the tag is taken unless forced.
    let ls = site.devctl_ok(&alice, &["image", "ls"]);
    assert!(ls.contains("mymodel:v1") && ls.contains("READY"), "{ls}");
    let bobs = site.devctl_ok(&bob, &["image", "ls"]);
    assert!(bobs.starts_with("no images"), "{bobs}");
    let again = site.devctl(&alice, &["freeze", "train1", "--tag", "mymodel:v1"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let all = site.devctl_ok(&site.admin.clone(), &["image", "ls", "--all"]);
    assert!(all.contains("mymodel:v1"), "{all}");

    // Removal deletes the SIF file; the session is untouched throughout.
    let removed = site.devctl_ok(&alice, &["image", "rm", "mymodel:v1"]);
    assert!(removed.contains("removed (DELETED)"), "{removed}");
    site.wait_until("the SIF file to go", Duration::from_secs(10), || {
        (!std::path::Path::new(&sif).exists()).then_some(())
    });
    let (code, text) = docker_exec(&container, &["cat", "/opt/model/weights.txt"]);
    assert_eq!((code, text.trim()), (0, "weights v1"));
    site.wait_for_state(&alice, "train1", "WAITING");
    let _ = Command::new("docker")
        .args(["image", "rm", "-f", &docker_image])
        .output();
}
