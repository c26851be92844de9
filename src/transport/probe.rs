//! The RDMA probe: which verbs devices this host has, their port states, and
//! whether any is usable — the answer `kvsync probe` prints and `auto`
//! transport selection starts from.
//!
//! Owns the device listing through libibverbs (`ibv_get_device_list`: a NULL
//! list with ENOSYS means the kernel has no RDMA stack) and soft-device
//! detection (`rxe*`, `siw*`). Built without the `rdma` feature it reports
//! that instead of probing.

use serde::Serialize;

/// One port of a device.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub state: String,
    pub active: bool,
    pub link_layer: String,
}

/// One verbs device.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    /// Software device (soft-RoCE `rxe*` or soft-iWARP `siw*`).
    pub soft: bool,
    pub ports: Vec<PortInfo>,
}

/// What the probe found.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// A device with an ACTIVE port exists.
    pub rdma_available: bool,
    /// Why RDMA is or is not available, for humans.
    pub reason: String,
    pub devices: Vec<DeviceInfo>,
    /// The device `auto` would use.
    pub device: Option<String>,
}

/// True for software RDMA devices, which get the runtime caps of DESIGN.md §2.
pub fn is_soft(name: &str) -> bool {
    name.starts_with("rxe") || name.starts_with("siw")
}

/// Probes the host.
pub fn probe() -> Probe {
    match list_devices() {
        Err(reason) => Probe {
            rdma_available: false,
            reason,
            devices: Vec::new(),
            device: None,
        },
        Ok(devices) => decide(devices),
    }
}

/// Picks the first device with an ACTIVE port.
fn decide(devices: Vec<DeviceInfo>) -> Probe {
    if devices.is_empty() {
        return Probe {
            rdma_available: false,
            reason: "no RDMA: no verbs devices on this host".into(),
            devices,
            device: None,
        };
    }
    let chosen = devices
        .iter()
        .find(|d| d.ports.iter().any(|p| p.active))
        .cloned();
    match chosen {
        Some(d) => {
            let port = d.ports.iter().find(|p| p.active).expect("active port");
            let soft = if d.soft {
                " (soft device: runtime caps chunk ≤ 32 MiB, pipeline ≤ 64, signal ≤ 64)"
            } else {
                ""
            };
            Probe {
                rdma_available: true,
                reason: format!("{} port {} is ACTIVE{soft}", d.name, port.port),
                device: Some(d.name.clone()),
                devices,
            }
        }
        None => Probe {
            rdma_available: false,
            reason: "no RDMA: no device has an ACTIVE port".into(),
            devices,
            device: None,
        },
    }
}

#[cfg(not(feature = "rdma"))]
fn list_devices() -> Result<Vec<DeviceInfo>, String> {
    Err("no RDMA: kvsync was built without the `rdma` feature".into())
}

#[cfg(feature = "rdma")]
fn list_devices() -> Result<Vec<DeviceInfo>, String> {
    use rdma_sys::*;
    use std::ffi::CStr;

    let mut n: i32 = 0;
    // SAFETY: plain libibverbs calls; every pointer is checked before use and
    // the list and contexts are freed on every path.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            return Err(if err.raw_os_error() == Some(libc::ENOSYS) {
                "no RDMA: the kernel has no RDMA support (ibv_get_device_list: ENOSYS)".into()
            } else {
                format!("no RDMA: ibv_get_device_list failed: {err}")
            });
        }
        let mut devices = Vec::new();
        for i in 0..n.max(0) as usize {
            let dev = *list.add(i);
            let name = CStr::from_ptr(ibv_get_device_name(dev))
                .to_string_lossy()
                .into_owned();
            let mut ports = Vec::new();
            let ctx = ibv_open_device(dev);
            if !ctx.is_null() {
                let mut attr = std::mem::zeroed::<ibv_device_attr>();
                if ibv_query_device(ctx, &mut attr) == 0 {
                    for port in 1..=attr.phys_port_cnt {
                        let mut pa = std::mem::zeroed::<ibv_port_attr>();
                        if ___ibv_query_port(ctx, port, &mut pa) == 0 {
                            ports.push(PortInfo {
                                port,
                                state: port_state(pa.state).into(),
                                active: pa.state == ibv_port_state::IBV_PORT_ACTIVE,
                                // IBV_LINK_LAYER_* (an anonymous enum in verbs.h).
                                link_layer: match pa.link_layer {
                                    1 => "InfiniBand",
                                    2 => "Ethernet",
                                    _ => "unspecified",
                                }
                                .into(),
                            });
                        }
                    }
                }
                ibv_close_device(ctx);
            }
            devices.push(DeviceInfo {
                soft: is_soft(&name),
                name,
                ports,
            });
        }
        ibv_free_device_list(list);
        Ok(devices)
    }
}

#[cfg(feature = "rdma")]
fn port_state(s: rdma_sys::ibv_port_state::Type) -> &'static str {
    use rdma_sys::ibv_port_state::*;
    match s {
        IBV_PORT_DOWN => "DOWN",
        IBV_PORT_INIT => "INIT",
        IBV_PORT_ARMED => "ARMED",
        IBV_PORT_ACTIVE => "ACTIVE",
        IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, states: &[bool]) -> DeviceInfo {
        DeviceInfo {
            name: name.into(),
            soft: is_soft(name),
            ports: states
                .iter()
                .enumerate()
                .map(|(i, &active)| PortInfo {
                    port: i as u8 + 1,
                    state: if active { "ACTIVE" } else { "DOWN" }.into(),
                    active,
                    link_layer: "Ethernet".into(),
                })
                .collect(),
        }
    }

    #[test]
    fn soft_devices_are_recognised() {
        assert!(is_soft("rxe0") && is_soft("siw_eth0"));
        assert!(!is_soft("mlx5_0"));
    }

    #[test]
    fn first_device_with_an_active_port_is_chosen() {
        let p = decide(vec![dev("mlx5_0", &[false]), dev("rxe0", &[false, true])]);
        assert!(p.rdma_available);
        assert_eq!(p.device.as_deref(), Some("rxe0"));
        assert!(p.reason.contains("rxe0 port 2 is ACTIVE") && p.reason.contains("soft device"));
        let p = decide(vec![dev("mlx5_0", &[false])]);
        assert!(!p.rdma_available && p.reason.contains("no device has an ACTIVE port"));
        assert!(decide(vec![]).reason.starts_with("no RDMA"));
    }

    #[test]
    fn this_build_host_has_no_rdma() {
        // The build machines have no RDMA NIC and no kernel RDMA stack; the
        // probe must say so cleanly rather than fail. (Inside the soft-RoCE VM
        // the same binary finds rxe0: see tests/rxe_vm.rs.)
        if std::path::Path::new("/sys/class/infiniband").exists() {
            return;
        }
        let p = probe();
        assert!(!p.rdma_available);
        assert!(p.reason.starts_with("no RDMA"), "{}", p.reason);
    }
}
