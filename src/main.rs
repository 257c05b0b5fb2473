//! The `headroom` binary: parse arguments, run the subcommand, map errors to exit codes.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = headroom::cli::Cli::parse();
    headroom::cli::quiet_on_closed_pipe(&cli);
    headroom::cli::init_logging();
    match headroom::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let code = headroom::cli::exit_code(&err);
            if code != headroom::protocol::ExitCode::Preempted {
                eprintln!("error: {err:#}");
            }
            ExitCode::from(code.code() as u8)
        }
    }
}
