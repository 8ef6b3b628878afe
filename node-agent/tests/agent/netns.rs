//! Network namespaces a test makes itself (`ip netns add`, a veth pair to the host, addresses
//! the test chooses), so that a destination "outside" a container is still on this machine: a
//! test that reaches one, or wrongly could, sends nothing off it.

use std::net::TcpListener as StdListener;
use std::os::fd::AsFd;
use std::process::Command;

use crate::unique;

/// A network namespace with a veth pair to the host, removed on drop.
pub struct TestNetns {
    name: String,
}

impl TestNetns {
    /// `ongt<id>` with the given /24s: the namespace takes `.2` of each, the host `.1`.
    pub fn new(networks: &[[u8; 3]]) -> Self {
        let id = &unique()[..6];
        let netns = Self {
            name: format!("ongt{id}"),
        };
        let host_end = format!("vh{id}");
        let ns_end = format!("vn{id}");
        let ip = |args: &[&str]| {
            let output = Command::new("ip")
                .args(args)
                .output()
                .expect("the ip command");
            assert!(
                output.status.success(),
                "ip {} failed (the tests run as root): {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            );
        };
        ip(&["netns", "add", &netns.name]);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", &ns_end,
        ]);
        ip(&["link", "set", &ns_end, "netns", &netns.name]);
        for [a, b, c] in networks {
            ip(&[
                "addr",
                "add",
                &format!("{a}.{b}.{c}.1/24"),
                "dev",
                &host_end,
            ]);
            ip(&[
                "netns",
                "exec",
                &netns.name,
                "ip",
                "addr",
                "add",
                &format!("{a}.{b}.{c}.2/24"),
                "dev",
                &ns_end,
            ]);
        }
        ip(&["link", "set", &host_end, "up"]);
        ip(&[
            "netns",
            "exec",
            &netns.name,
            "ip",
            "link",
            "set",
            &ns_end,
            "up",
        ]);
        ip(&[
            "netns",
            "exec",
            &netns.name,
            "ip",
            "link",
            "set",
            "lo",
            "up",
        ]);
        netns
    }

    /// A listener on all addresses of the namespace, on a port the kernel picks.
    pub fn listener(&self) -> StdListener {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("the namespace file");
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("entering the namespace (root)");
            StdListener::bind("0.0.0.0:0").expect("bind in the namespace")
        })
        .join()
        .expect("the thread")
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
