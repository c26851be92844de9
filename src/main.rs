//! `kvsync` binary entry point: everything lives in the library's `cli`.

fn main() -> std::process::ExitCode {
    kvsync::cli::main()
}
