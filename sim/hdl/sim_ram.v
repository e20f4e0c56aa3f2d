// Byte-writable RAM for Verilator-built simulations: two read and two write ports for
// the node's unaligned beats, one word-wide backdoor for the testbench. Written in
// Verilog because Amaranth elaborates a memory's initial contents word by word, which
// for megabytes costs more than the whole rest of a multi-node build.
module fpgaccl_sim_ram #(parameter WIDTH = 64, parameter AW = 10) (
    input  wire                 clk,
    input  wire [AW-1:0]        ra0, input wire re0, output reg [WIDTH-1:0] rd0,
    input  wire [AW-1:0]        ra1, input wire re1, output reg [WIDTH-1:0] rd1,
    input  wire [AW-1:0]        ra2, output reg [WIDTH-1:0] rd2,
    input  wire [AW-1:0]        wa0, input wire [WIDTH/8-1:0] we0, input wire [WIDTH-1:0] wd0,
    input  wire [AW-1:0]        wa1, input wire [WIDTH/8-1:0] we1, input wire [WIDTH-1:0] wd1,
    input  wire [AW-1:0]        wa2, input wire we2, input wire [WIDTH-1:0] wd2
);
    reg [WIDTH-1:0] mem [0:(1 << AW) - 1];
    integer i;
    always @(posedge clk) begin
        if (re0) rd0 <= mem[ra0];
        if (re1) rd1 <= mem[ra1];
        rd2 <= mem[ra2];
        for (i = 0; i < WIDTH / 8; i = i + 1) begin
            if (we0[i]) mem[wa0][i*8 +: 8] <= wd0[i*8 +: 8];
            if (we1[i]) mem[wa1][i*8 +: 8] <= wd1[i*8 +: 8];
        end
        if (we2) mem[wa2] <= wd2;
    end
endmodule
